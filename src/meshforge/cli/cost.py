"""`meshforge cost`: placeholder while being written."""
