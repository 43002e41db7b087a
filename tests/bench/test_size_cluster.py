"""bench.size_cluster: the fewest cards meeting the P99s, found with the production policy's simulator."""

from __future__ import annotations

import pytest

from bench.size_cluster import main, offered_cards, parse_mix, size_cluster


def test_a_higher_rate_needs_more_cards_and_every_searched_row_is_reported():
    low, low_rows = size_cluster(0.06, 5.0, 600.0, arrivals=60, max_cards=12)
    high, high_rows = size_cluster(0.12, 5.0, 600.0, arrivals=60, max_cards=12)
    assert low is not None and high is not None
    assert high.cards > low.cards
    # Counts below the answer were searched and failed (or could not carry the offered work).
    assert all(not r.meets for r in low_rows if r.cards < low.cards)
    assert {r.cards for r in low_rows} == set(range(1, low.cards + 1))
    assert low.image_p99 <= 5.0 and low.video_p99 <= 600.0
    assert any(r.split == "policy" for r in low_rows if r.cards == low.cards)
    # The offered work sets a floor: 0.06/s of the seed's mix is 2.7 busy cards.
    assert offered_cards(0.06, 0.8) == pytest.approx(2.69, abs=0.01) and low.cards >= 3


def test_the_command_prints_its_table_and_answer(capsys):
    assert (
        main(
            [
                "--rate",
                "0.06",
                "--image-p99",
                "5",
                "--video-p99",
                "600",
                "--arrivals",
                "40",
                "--mix",
                "image=0.8,video=0.2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| cards | split |" in out and "| policy |" in out and "answer:" in out


def test_a_mix_is_checked():
    assert parse_mix("image=0.7,video=0.3") == pytest.approx(0.7)
    with pytest.raises(Exception, match="add up to 1"):
        parse_mix("image=0.7,video=0.7")
