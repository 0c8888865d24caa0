import pytest

from envs.rag import (
    CorpusError,
    Document,
    QAFileError,
    QAItem,
    RetrieverConfigError,
    chunk_documents,
    generate,
    load_corpus,
    load_directory,
    load_hf_documents,
    load_jsonl_documents,
    load_medquad,
    load_qa_jsonl,
    split_items,
)
from envs.rag.qa import check_gold_ids


def test_chunking_covers_every_word_with_overlap():
    words = [f"w{i}" for i in range(130)]
    doc = Document("d1", "Title", " ".join(words))
    chunks = chunk_documents([doc], chunk_size=50, chunk_overlap=10)
    assert [c.id for c in chunks] == ["d1#0", "d1#1", "d1#2"]
    assert [c.index for c in chunks] == [0, 1, 2]
    assert all(c.doc_id == "d1" and c.title == "Title" for c in chunks)
    assert chunks[0].text.split()[-10:] == chunks[1].text.split()[:10]  # the overlap
    covered = {w for c in chunks for w in c.text.split()}
    assert covered == set(words)  # the tail is not dropped
    assert chunks[0].search_text.startswith("Title. w0")
    short = chunk_documents([Document("d2", "", "a few words")], chunk_size=50, chunk_overlap=10)
    assert [c.text for c in short] == ["a few words"] and short[0].search_text == "a few words"


@pytest.mark.parametrize(("size", "overlap"), [(0, 0), (10, 10), (10, -1), (True, 0)])
def test_bad_chunking_names_the_value(size, overlap):
    with pytest.raises(RetrieverConfigError, match="chunk_"):
        chunk_documents([Document("d", "", "x y z")], chunk_size=size, chunk_overlap=overlap)


def test_empty_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="no documents"):
        load_corpus([])
    with pytest.raises(CorpusError, match="no text to index"):
        chunk_documents([Document("a", "t", "   "), Document("b", "t", "")])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.md").write_text("  \n")
    with pytest.raises(CorpusError, match="no non-empty"):
        load_directory(empty)
    with pytest.raises(CorpusError, match="not found"):
        load_directory(tmp_path / "missing")
    with pytest.raises(CorpusError, match="used twice"):
        load_corpus([Document("a", "", "x"), Document("a", "", "y")])


def test_load_directory_reads_txt_and_md_recursively(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.md").write_text("# Router manual\n\nHold reset for ten seconds.")
    (tmp_path / "sub" / "b.txt").write_text("Plain notes about the modem.")
    (tmp_path / "skip.csv").write_text("x,y")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe broken")
    with pytest.raises(CorpusError, match="bad.txt is not UTF-8"):
        load_directory(tmp_path)
    (tmp_path / "bad.txt").unlink()
    docs = load_directory(tmp_path)
    assert [(d.id, d.title) for d in docs] == [("a.md", "Router manual"), ("sub/b.txt", "b")]
    assert load_corpus(tmp_path) == docs


def test_jsonl_corpus_and_broken_line_names_the_line(tmp_path, write_jsonl):
    good = write_jsonl(
        tmp_path / "docs.jsonl",
        [{"id": "x1", "title": "One", "text": "first", "lang": "en"}, {"text": "second"}, ""],
    )
    docs = load_jsonl_documents(good)
    assert [(d.id, d.title, d.text) for d in docs] == [
        ("x1", "One", "first"),
        ("line-2", "", "second"),
    ]
    assert docs[0].metadata == {"lang": "en"}
    broken = write_jsonl(
        tmp_path / "broken.jsonl", [{"text": "ok"}, {"text": "ok too"}, '{"text": "cut off']
    )
    with pytest.raises(CorpusError, match=r"broken.jsonl, line 3: not valid JSON"):
        load_corpus(broken)
    no_text = write_jsonl(tmp_path / "notext.jsonl", [{"text": "ok"}, {"body": "x"}])
    with pytest.raises(CorpusError, match=r"line 2: field 'text' must be a string.*\['body'\]"):
        load_jsonl_documents(no_text)
    not_obj = write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(CorpusError, match="line 1: expected a JSON object, got list"):
        load_jsonl_documents(not_obj)
    with pytest.raises(CorpusError, match="neither a folder"):
        load_corpus(tmp_path / "docs.csv")


def test_datasets_loader_on_local_files(tmp_path, write_jsonl):
    import datasets

    rows = [{"pid": f"p{i}", "body": f"text {i}", "head": f"T{i}"} for i in range(3)]
    path = write_jsonl(tmp_path / "ds.jsonl", rows)
    docs = load_hf_documents(path, text_column="body", title_column="head", id_column="pid")
    assert [(d.id, d.title, d.text) for d in docs][1] == ("p1", "T1", "text 1")
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "ds.csv"))
    assert load_hf_documents(tmp_path / "ds.csv", text_column="body")[2].id == "row-2"
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert len(load_hf_documents(tmp_path / "saved", text_column="body")) == 3
    with pytest.raises(CorpusError, match=r"no column\(s\) \['text'\]"):
        load_hf_documents(path)


def test_qa_file_loads_and_names_bad_lines(tmp_path, write_jsonl):
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {"question": "Q1?", "answers": ["A", "a1"], "gold_doc_ids": ["d1"], "split": "test"},
            {"question": "Q2?", "answer": "B", "gold_doc_id": "d2", "id": "mine", "hint": 1},
        ],
    )
    first, second = load_qa_jsonl(path)
    assert first == QAItem("q-1", "Q1?", ("A", "a1"), ("d1",), "test")
    assert (second.id, second.answers, second.gold_doc_ids) == ("mine", ("B",), ("d2",))
    assert second.metadata == {"hint": 1}
    cases = [
        ('{"question": "Q?", "answers": ["A"]}\n{"question": ', "line 2: not valid JSON"),
        ('{"question": "", "answers": ["A"]}', "line 1: 'question' must be"),
        ('{"question": "Q?"}', "line 1: needs 'answers'"),
        ('{"question": "Q?", "answers": [""]}', "line 1: 'answers' is empty"),
        ('{"question": "Q?", "answers": "A", "split": "dev"}', "line 1: 'split' must be"),
        ('{"question": "Q?", "answers": [{"x": 1}]}', "line 1: 'answers' must be a string"),
    ]
    for text, message in cases:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(QAFileError, match=message):
            load_qa_jsonl(bad)
    with pytest.raises(QAFileError, match=r"gold document\(s\) \['d2'\]"):
        check_gold_ids([second], [Document("d1", "", "x")])


def test_medquad_style_loader_on_a_local_file(tmp_path):
    import datasets

    rows = [
        {"qtype": "symptoms", "Question": "What are the symptoms of X?", "Answer": "Fever."},
        {"qtype": "treatment", "Question": "How to treat X?", "Answer": "Rest and fluids."},
        {"qtype": "symptoms", "Question": "What are signs of X?", "Answer": "Fever."},  # dup
        {"qtype": "symptoms", "Question": "", "Answer": "skipped"},
    ]
    path = tmp_path / "medquad.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    docs, items = load_medquad(path)
    assert len(docs) == 2 and len(items) == 3  # duplicate answers share one document
    assert items[0].gold_doc_ids == items[2].gold_doc_ids
    assert docs[0].title == "symptoms" and items[1].answers == ("Rest and fluids.",)
    check_gold_ids(items, docs)
    with pytest.raises(CorpusError, match="Question"):
        load_medquad(path, question_column="Question ")


def test_hub_loader_offline_fails_with_a_hint():
    with pytest.raises(CorpusError, match="Offline\\? Pass a local"):
        load_medquad("agentenv-tests/no-such-dataset")


def test_bundled_data_is_deterministic_and_splits_are_disjoint_by_document():
    docs, qa = generate()
    assert len(docs) == 360 and len(qa) == 990
    assert generate() == (docs, qa)  # same seed, same corpus and questions
    assert generate(seed=1)[0] != docs
    train, test = split_items(qa, "train"), split_items(qa, "test")
    assert len(train) + len(test) == len(qa) and 150 < len(test) < 250
    assert not {q.question for q in train} & {q.question for q in test}
    assert not {g for q in train for g in q.gold_doc_ids} & {
        g for q in test for g in q.gold_doc_ids
    }
    assert {q.metadata["qtype"] for q in test} == {"id", "name", "paraphrase", "mixed"}
    check_gold_ids(qa, docs)
    assert len({q.question for q in qa}) == len(qa)
