"""The bank: filter types, their separable factors, derived features and the outputs a file
stores."""
