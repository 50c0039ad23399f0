"""CPU kernels of our own, in C++ on ATen's portable vector layer, built from this folder's sources on first
use (paged_attention.py: the paged decode attention that reads the KV blocks in place)."""
