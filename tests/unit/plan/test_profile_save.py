"""How `Profile.save` writes a machine profile (`rekv_core.plan.profile`): into a folder it makes,
in the layout the shipped profiles have, so a profile written again diffs line by line."""

from importlib import resources

from rekv_core.plan.estimates import LayerCost
from rekv_core.plan.profile import Profile, shipped_profile


def test_a_profile_is_saved_into_folders_that_do_not_exist_yet(tmp_path):
    profile = Profile("smollm2-135m", "cpu", "float32", 2, LayerCost([256], [2.5]),
                      quantize_ms_per_mib={"int8": 0.4}, restore_ms_per_mib={"int8": 0.3})
    path = tmp_path / "profiles" / "this-machine" / "profile.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded.layer_cost.at(256) == 2.5 and loaded.restore_ms_per_mib == {"int8": 0.3}


def test_a_saved_profile_has_the_layout_of_the_shipped_one(tmp_path):
    """The shipped profile loaded and saved again is the same file, byte for byte: one key or
    figure a line, indented by one space, a newline at the end."""
    shipped = resources.files("rekv_core.plan").joinpath("profiles", "smollm2-135m.json")
    path = tmp_path / "again.json"
    shipped_profile("smollm2-135m").save(path)
    assert path.read_text() == shipped.read_text()
