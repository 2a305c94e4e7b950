"""The platform CA: certificates for the control plane, agents and services (see the functions)."""
