from bnpfed.validation import check_names, check_tensor  # noqa: F401  (re-export until bnpfed/flower/records.py imports bnpfed.validation)
