//! afm-server
