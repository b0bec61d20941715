"""The metric definitions: what Ray's metric layer accepts and what a scrape shows."""

from services.metrics import SPECS, exported_names


def test_descriptions_and_names_are_ascii():
    # Ray's C++ metric layer refuses non-ASCII descriptions (UnicodeEncodeError at replica start).
    for spec in SPECS:
        spec.name.encode("ascii")
        spec.description.encode("ascii")


def test_exported_names_follow_ray_prefix_and_kind_suffixes():
    names = exported_names()
    assert "ray_dflash_spec_decode_num_drafts_total" in names
    assert "ray_dflash_kv_cache_usage_perc" in names
    assert {"ray_dflash_acceptance_length_bucket", "ray_dflash_acceptance_length_sum",
            "ray_dflash_acceptance_length_count"} <= names
    assert len(names) == sum(3 if s.kind == "histogram" else 1 for s in SPECS)
