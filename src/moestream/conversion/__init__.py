"""The store and what writes, checks and sizes it: the format (store), checkpoint reading (source),
low-bit formats (quant), checkpoint -> store (convert), verification, byte arithmetic and config fields
(sizes), the meta-device model skeleton, the inspect verb, synthetic models."""
