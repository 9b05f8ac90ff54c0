"""The vramshare mutating admission webhook (aiohttp, TLS)."""
