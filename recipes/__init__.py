# Our recipes package. torchtune's wheel also installs a top-level package named
# `recipes` (whose __init__ raises on import), and `tune run recipes/<file>.py` imports
# `recipes.<file>` by module name. The editable install (see hatch_build.py) puts a
# finder at the front of sys.meta_path that resolves the name `recipes` to this
# folder, so this file, not torchtune's, is the one that runs.
