"""One file per object kind the operator owns, each holding its decide-and-ensure step and its builder."""
