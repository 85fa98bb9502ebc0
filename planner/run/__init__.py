"""planner.run"""
