"""The vramshare controller: GPU inventory from DCGM, and the reservation lifecycle (kopf)."""
