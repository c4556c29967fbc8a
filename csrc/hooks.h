// PrivateUse1 hooks for remote_accelerator; see hooks.cpp.
#pragma once

namespace genie {

// Installs Genie's at::PrivateUse1HooksInterface. Idempotent; raises c10::Error
// if another extension already owns the PrivateUse1 hooks.
void register_hooks();

} // namespace genie
