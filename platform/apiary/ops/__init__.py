"""Operations: the Alertmanager intake and the alert log."""
