"""posttrain: the library (no Prefect). Importing it pins MKL's reproducible mode before anything
multiplies (`posttrain.numerics`)."""

from posttrain.numerics import pin

pin()
