"""The training loop and the Task protocol it drives (`loop`, `task`)."""
