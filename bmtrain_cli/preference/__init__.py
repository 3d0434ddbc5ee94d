"""Preference fine-tuning (``train_config.stage: dpo``): pair data, reference log-probs and the DPO, IPO,
SimPO and ORPO losses. The trainer calls one :class:`~bmtrain_cli.preference.objective.PreferenceObjective`
in place of the SFT token loss; docs/preference.md describes the whole feature.
"""
