//! afm-api
