# Re-export until bnpfed/flower/records.py imports bnpfed.validation; then delete this file.
from bnpfed.validation import check_names, check_tensor  # noqa: F401
