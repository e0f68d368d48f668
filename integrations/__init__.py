"""Framework adapters: each translates a framework's parallel state, live tensors and update
lifecycle into the plan's terms (ranks, identities, tensors) and checks them."""
