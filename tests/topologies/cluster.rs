//! Tests on a cluster topology.
