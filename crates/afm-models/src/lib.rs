//! afm-models
