"""Compatibility layers for code written against other controller libraries."""
