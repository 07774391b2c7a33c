//! Tests on a sentinel topology.
