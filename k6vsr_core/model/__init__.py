"""The model: its bundle (found, checked, loaded; tiny random ones), the networks and their fast paths, the stages,
memory budgets, warm-up and the in-memory runner. Above `contract`, `media` and `device`."""
