"""`meshforge train` and `meshforge worker`."""
