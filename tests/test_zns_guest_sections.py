"""The section protocol of the shared QEMU boot (tests/zns_guest.py), run by a local bash:
each section's own output and exit status, whatever the one before did."""
import subprocess

import zns_guest as Z


def test_sections_keep_their_own_output_and_status():
    sections = {"ok": "echo RESULT one; echo more", "fails": "echo two; exit 3",
                "reads-stdin": "cat; echo after-cat",      # stdin is /dev/null: no hang
                "env": 'echo "dev=$RETAINZ_ZNS_DEV2"', "last": "echo QZ_END ok 9; true"}
    p = subprocess.run(["bash", "-c", Z.script(sections)], capture_output=True, text=True,
                       timeout=30, env={"PATH": "/usr/bin:/bin", "RETAINZ_ZNS_DEV2": "/dev/x"})
    got = Z.parse(p.stdout)
    assert list(got) == list(sections)
    assert got["ok"] == Z.Section(0, "RESULT one\nmore\n")
    assert got["fails"] == Z.Section(3, "two\n")
    assert got["reads-stdin"] == Z.Section(0, "after-cat\n")
    assert got["env"].stdout == "dev=/dev/x\n"
    # another section's end marker in a section's output is only output
    assert got["last"] == Z.Section(0, "QZ_END ok 9\n")


def test_a_section_cut_off_has_no_status_and_keeps_what_it_printed():
    got = Z.parse("noise\nQZ_BEGIN a\nx\nQZ_END a 0\nQZ_BEGIN b\npartial\n")
    assert got == {"a": Z.Section(0, "x\n"), "b": Z.Section(None, "partial\n")}
    run = Z.GuestRun(124, "out", "err", got)
    assert run.section("a").stdout == "x\n"
    for name in ("b", "absent"):
        try:
            run.section(name)
        except AssertionError as e:
            assert "did not finish" in str(e) and "runner rc 124" in str(e)
        else:
            raise AssertionError(f"section {name} passed as finished")
