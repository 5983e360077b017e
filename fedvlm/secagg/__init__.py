"""Secure aggregation (SecAgg+, Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead"): the server learns the sum of the round's surviving clients'
vectors and nothing else about any one of them.

- ``masks``: the pseudorandom masks and the arithmetic modulo 2^bits;
- ``graph``: who shares secrets with whom (a complete graph, or SecAgg+'s random Harary graph);
- ``shamir``: Shamir sharing of a seed or a key's scalar, one element of a prime field;
- ``node``: one node's secrets and checks for one round;
- ``server``: the server's side, from the keys to the unmasked sum.

The cryptographic primitives are maintained libraries': elliptic-curve Diffie-Hellman and
authenticated encryption (``cryptography``, through ``flwr.common.secure_aggregation``), ChaCha20
for the masks; Shamir sharing is ``shamir``'s (a polynomial over the prime field of 2^521 - 1 in
Python's integers: PyCryptodome's GF(2^128), which Flower uses, is arithmetic written in Python
and was most of the protocol's cost). What
this package adds is the protocol's bookkeeping and the checks a node makes before it helps
the server remove a mask (docs/privacy.md, "Secure aggregation", states what they prove).
"""
