"""The package version (also written into every manifest's writer record)."""

__version__ = "0.2.0"
