"""planner.model"""
