"""Memory and step-time estimates and recommendations: `estimate`, `planner`, `model_shapes`,
and the run reports (`report`).
"""
