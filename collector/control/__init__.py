"""The closed loop: the Control service, the actions audit trail, the controller (DESIGN §4, §9)."""
