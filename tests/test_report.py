

def test_the_shared_cores_note_names_ranks_and_cores_only_where_they_collide(monkeypatch):
    from ds_pipe_ext.instrument.rundir import host_record, shared_cores_note

    assert shared_cores_note({"device_type": "cpu", "ranks_on_host": 4, "cores": 2}).startswith(
        "the prediction cannot hold here: 4 CPU ranks shared 2 cores")
    assert shared_cores_note({"device_type": "cpu", "ranks_on_host": 2, "cores": 2}) == ""
    assert shared_cores_note({"device_type": "cuda", "ranks_on_host": 8, "cores": 2}) == ""
    assert shared_cores_note(None) == ""  # a run directory written before the host was recorded
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert host_record("cpu")["ranks_on_host"] == 4
