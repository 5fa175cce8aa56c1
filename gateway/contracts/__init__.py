"""Contracts the gateway and the reference worker share: chat rendering (pure) and the
aiohttp middleware that cancels a request whose client went away."""
