"""Entity accuracy of generated agent turns (seed 002 "turns[].entities", issue 18): a hand-made report
whose figures are worked out by hand below, the matching rules one by one, the renderer's `answer`
index that ties an entity to its assistant message, and sums that add across hosts."""

from __future__ import annotations

import pytest

from data_pipeline.tokenizer import load_tokenizer
from tests.test_evaluate_units import FakeHosts
from tests.test_render_vakforge import TOKENIZER, conversation, dataset, render_one
from valen_jax.evaluation import hosts
from valen_jax.evaluation.metrics.entities import EntityStats, Generated, entity_found, numbers_in


def entity(kind: str, text: str, normalized=None) -> dict:
    return {"type": kind, "text": text, "normalized": normalized}


HI = {"locale": "hi-Latn-IN", "source": "real"}
US = {"locale": "en-US", "source": "synthetic"}
GB = {"locale": "en-GB", "source": "public"}

# (breakdown, reference entities of one agent message, generated text, generated calls, found per entity)
HAND_MADE = [
    # 1. Hinglish, real: the amount as "Rs 500.00" (number rule), the date only in the call's arguments
    #    (normalised ISO string), the customer id written "sc 4471" (identifier rule).
    (HI, [entity("amount_inr", "₹500", 500), entity("date", "kal subah", "2026-09-17"),
          entity("customer_id", "SC-4471")],
     "Ji, Rs 500.00 lagega, customer sc 4471.",
     [{"name": "book_appointment", "arguments": {"customer_id": "SC4471", "date": "2026-09-17"}}],
     [True, True, True]),
    # 2. Hinglish, real: ₹5000 is not ₹500 (boundary, and 5000 ≠ 500); the phone behind +91 is found.
    (HI, [entity("amount_inr", "₹500", 500), entity("phone", "98765 43210", "9876543210")],
     "Charge ₹5000 hoga. Number +91 98765-43210 pe call karenge.", [],
     [False, True]),
    # 3. US, synthetic: the date said differently ("Sept. 20th") and not in any argument: missed; the
    #    order id found case-folded; the person's name found inside a sentence.
    (US, [entity("date", "September 20", "2026-09-20"), entity("order_id", "NW-20417"),
          entity("person_name", "Priya")],
     "Your order nw-20417 arrives Sept. 20th. PRIYA will call.", [],
     [False, True, True]),
    # 4. US, synthetic: nothing generated that holds the id (NW-204171 is a longer id); the amount is a
    #    number argument.
    (US, [entity("order_id", "NW-20417"), entity("amount_usd", "$12.50", 12.5)],
     "Refund for NW-204171 is on its way.", [{"name": "refund", "arguments": {"amount": 12.5}}],
     [False, True]),
    # 5. GB, public: a reading given as 04512 is the number 4512 in the text; an address missed.
    (GB, [entity("meter_reading", "04512", 4512), entity("address", "12 High Street")],
     "I have logged 4,512 for you.", [],
     [True, False]),
]


def hand_made_stats() -> EntityStats:
    stats = EntityStats()
    for breakdown, entities, text, calls, _ in HAND_MADE:
        stats.add_message(entities, Generated.of(text, calls), breakdown)
    return stats


def test_each_hand_made_entity_is_found_or_missed_as_worked_out():
    for breakdown, entities, text, calls, expected in HAND_MADE:
        generated = Generated.of(text, calls)
        assert [entity_found(e, generated) for e in entities] == expected, (breakdown, text)


def test_hand_made_report_matches_the_figures_worked_out_by_hand():
    report = hand_made_stats().report()
    # 3 + 2 + 3 + 2 + 2 = 12 entities, 3 + 1 + 2 + 1 + 1 = 8 found.
    assert report["overall"] == {"entities": 12, "correct": 8, "accuracy": pytest.approx(2 / 3)}
    by_type = {k: (v["correct"], v["entities"]) for k, v in report["by_type"].items()}
    assert by_type == {"address": (0, 1), "amount_inr": (1, 2), "amount_usd": (1, 1), "customer_id": (1, 1),
                       "date": (1, 2), "meter_reading": (1, 1), "order_id": (1, 2), "person_name": (1, 1),
                       "phone": (1, 1)}
    assert report["by_type"]["amount_inr"]["accuracy"] == 0.5
    # hi-Latn-IN: messages 1-2 → 4 of 5; en-US: 3-4 → 3 of 5; en-GB: 5 → 1 of 2.
    assert {k: (v["correct"], v["entities"]) for k, v in report["by_locale"].items()} == {
        "en-GB": (1, 2), "en-US": (3, 5), "hi-Latn-IN": (4, 5)}
    assert {k: (v["correct"], v["entities"]) for k, v in report["by_source"].items()} == {
        "public": (1, 2), "real": (4, 5), "synthetic": (3, 5)}
    assert report["by_locale"]["en-US"]["accuracy"] == pytest.approx(0.6)


def test_sums_of_two_hosts_give_the_one_host_report():
    # Process 0 holds messages 0, 2, 4 and process 1 messages 1, 3 (hosts.local_indices): different
    # group keys (en-GB only on process 0); the all-reduced report is the one-host report.
    parts = [EntityStats(), EntityStats()]
    for i, (breakdown, entities, text, calls, _) in enumerate(HAND_MADE):
        parts[i % 2].add_message(entities, Generated.of(text, calls), breakdown)
    assert set(parts[0].group_keys()) != set(parts[1].group_keys())
    fake = FakeHosts(2)
    summed = fake.run(lambda i: hosts.sum_stats(parts[i], fake.gather).report())
    assert summed[0] == summed[1] == hand_made_stats().report()


def test_numbers_are_read_in_any_script_with_thousands_groups():
    assert numbers_in("₹1,00,000 or 1,290.00, ९८७ and ４５; 2026-09-20") == [100000, 1290, 987, 45, 2026, 9, 20]


@pytest.mark.parametrize(("entity_", "text", "found"), [
    (entity("amount_inr", "₹500"), "कुल ₹५०० होंगे", True),  # Devanagari digits, amount from the text
    (entity("amount_inr", "₹500"), "₹500", True),
    (entity("amount_inr", "₹ 1,500"), "1500 rupees", True),
    (entity("amount_inr", "₹500"), "₹50", False),
    (entity("phone", "(555) 123-4567"), "call 555.123.4567", True),
    (entity("phone", "(555) 123-4567"), "call 555 123 4568", False),
    (entity("phone", "555 123 4567"), "+1 555 123 4567", True),  # country code
    (entity("phone", "555 123 4567"), "12345-555-123-4567", False),  # 5 more digits: not a country code
    (entity("otp", "4821"), "your code is 4821", True),
    (entity("otp", "4821"), "your code is 48210", False),
    (entity("customer_id", "SC-4471"), "SC/4471", True),
    (entity("customer_id", "SC-4471"), "XSC-4471", False),
    (entity("person_name", "Zoë"), "ZOË here", True),
    (entity("person_name", "Ann"), "Anna here", False),
    (entity("date", "１７ Sept"), "17 sept", True),  # NFKC: full-width digits
])
def test_matching_rules(entity_, text, found):
    assert entity_found(entity_, Generated.of(text)) is found


def test_a_call_that_did_not_parse_is_searched_as_text():
    generated = Generated.of("", ['{"name": "lookup", "arguments": {"order": "NW-1"'])
    assert entity_found(entity("order_id", "NW-1"), generated)


def test_the_renderer_ties_agent_entities_to_their_assistant_message(tmp_path):
    # The conversation: system, user (entity), assistant "Yes. Checking order NW-1." (entity), assistant
    # with two calls, two tool messages, assistant "One is ok.": assistant messages 0, 1, 2.
    meta = render_one(load_tokenizer(TOKENIZER), dataset(tmp_path, conversation())).meta
    assert [(e["speaker"], e["message"], e["answer"]) for e in meta["entities"]] == [("user", 1, None),
                                                                                      ("agent", 2, 0)]
    assert meta["answers"] == ["Yes. Checking order NW-1.", "", "One is ok."]
    assert len(meta["answers"]) == len(meta["tool_calls"])
