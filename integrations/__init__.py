"""Framework adapters: each translates one framework's parallel state, live tensors and
update lifecycle into plan ranks, identities and tensors (see ARCHITECTURE.md)."""
