"""One module per ``dofla`` sub-command; each defines ``register(subparsers)``."""
