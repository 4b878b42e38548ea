class EvalInputError(ValueError):
    """A bad input to the eval (checkpoint, data file, task name, option).

    The message names the offending value and the fix; the recipe prints it as one line and exits non-zero.
    """
