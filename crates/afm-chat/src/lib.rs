//! afm-chat
