"""planner.hardware"""
