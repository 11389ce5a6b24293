"""Preference data: reading it, naming its persons, and bounding each person's contribution.

One room below the heads (``rewards``), so that every head reads preference data the same way
(PipelineDP's order: contribution bounding is a named stage of its own, before anything
aggregates). Every random or data-dependent choice here that touches one person's data uses only
that person's data and a stream of their own, seeded by (seed, person id): a change to one
person's rows changes nothing that is chosen for anyone else.
"""
