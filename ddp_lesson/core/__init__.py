"""The teaching cores: each lesson idea in one short module a notebook prints whole;
the hardened drop-ins are in the modules above."""
