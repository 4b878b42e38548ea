from finetune.base import BadInput


class EvalInputError(BadInput):
    """A bad input to the eval (checkpoint, data file, task name, option).

    The recipes' one bad-input error (finetune.base), under the eval's name: the message names the offending
    value and the fix; the recipe prints it as one line and exits non-zero.
    """
