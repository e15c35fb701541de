"""Benchmarks behind `meshforge scale` (and, later, `meshforge bench comm / io`)."""
