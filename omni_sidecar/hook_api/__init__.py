"""What a hook set implements and what it is given (the base class, the step's batch), its loading
by `--hooks`, and the guard that keeps a hook's error to the requests it names."""
