"""bnpfed's PFNM and posterior fusion as a Flower app."""
