"""OpenPAI's team-wise storage on the control plane: servers and configs (:mod:`.service`), what a
task mounts (:class:`.service.MountPlanner`) and a config's files (:mod:`.files`)."""
