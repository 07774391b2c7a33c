//! Tests on a tls topology.
