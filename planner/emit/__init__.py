"""planner.emit"""
