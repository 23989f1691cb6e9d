"""Readers and validators of the seed data formats, one module per format.

Every reader collects all problems of a file and raises one `errors.FormatError`
(DESIGN: errors are `PATH:LINE: FIELD: message`).
"""
