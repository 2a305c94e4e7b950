"""Operations: alert intake and automatic actions (incidents and on-call plug in here later)."""
