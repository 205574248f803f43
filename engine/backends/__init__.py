"""Engine backends. Each module imports its heavy dependencies itself, when loaded."""
