"""The many-rank protocol: communicators, the ownership plan, parallel save/load, levels."""
