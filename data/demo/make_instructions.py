"""Write data/demo/instructions.jsonl: templated everyday, writing, coding and arithmetic
instructions for the demo drafter (Alpaca schema, answers left empty: the target writes them).

Deterministic: `python data/demo/make_instructions.py` rewrites the same bytes.
"""

import json
import random
from pathlib import Path

N = 720


def _words(text: str) -> list[str]:
    return text.split(", ")


TOPICS = _words(
    "photosynthesis, gravity, the water cycle, inflation, vaccines, black holes, recycling, "
    "the internet, volcanoes, democracy, electricity, the moon, climate change, "
    "the human heart, rainbows, earthquakes, bees, compound interest, machine learning, "
    "the stock market, sleep, exercise, the Roman Empire, oceans, solar panels, batteries, "
    "friendship, music, coffee, chess, the immune system, wind energy, the printing press, "
    "glaciers, honey, tides, bread baking, the Olympic Games, dinosaurs, the piano, "
    "cloud computing, the French Revolution, coral reefs, bicycles, elections, antibiotics, "
    "the Milky Way, earth's seasons, tea, languages, maps, passwords, rivers, deserts, "
    "the human brain, airplanes"
)
THINGS = _words(
    "the sea, autumn leaves, a rainy morning, a city at night, an old dog, the stars, "
    "a mountain lake, a cup of tea, a quiet library, a summer garden, the first snow, "
    "a train journey, a lighthouse, a busy market, a candle, a snowy forest, a fishing boat, "
    "a birthday party, an empty beach, a thunderstorm, a mountain village, a red kite, "
    "a sleeping cat, a small bakery, a winter night, a field of sunflowers, an old bridge, "
    "a quiet river, a desert at dawn, a school playground"
)
ACTIVITIES = _words(
    "staying healthy, saving money, learning a language, studying for exams, "
    "sleeping better, cooking at home, running a first marathon, working from home, "
    "keeping a plant alive, travelling on a budget, writing an essay, public speaking, "
    "reducing stress, making friends in a new city, staying focused, planning a wedding, "
    "starting a garden, learning to swim, training a puppy, moving house, "
    "preparing for a job interview, drinking more water, reading more books, "
    "waking up early, learning to draw, keeping a journal, cycling to work, "
    "hosting a dinner party, learning the guitar, cleaning the kitchen"
)
TASKS = _words(
    "checks whether a number is prime, reverses a string, "
    "returns the largest item of a list, counts the vowels in a word, "
    "computes the factorial of n, sums the even numbers in a list, "
    "checks whether a word is a palindrome, converts Celsius to Fahrenheit, "
    "removes duplicates from a list, returns the n-th Fibonacci number, "
    "sorts a list of names alphabetically, counts the words in a sentence, "
    "returns the average of a list of numbers, checks whether two words are anagrams, "
    "capitalizes every word in a sentence, finds the smallest number in a list, "
    "merges two sorted lists, converts a number to binary, counts how often each letter "
    "appears, returns the longest word in a sentence"
)
PAIRS = [
    p.split(" / ")
    for p in _words(
        "a cat / a dog, tea / coffee, a lake / a sea, weather / climate, a virus / a bacterium, "
        "Python / JavaScript, renting / buying a house, a list / a tuple, speed / velocity, "
        "a star / a planet"
    )
]
JOBS = _words(
    "nurse, teacher, baker, pilot, farmer, software engineer, librarian, chef, firefighter, "
    "doctor, gardener, journalist, photographer, mechanic, architect, musician"
)
SENTENCES = _words(
    "Where is the train station?, I would like a cup of coffee., The weather is nice today., "
    "Thank you for your help., What time is it?, I love reading books."
)

TEMPLATES = [
    lambda r: f"Explain {r.choice(TOPICS)} in simple terms.",
    lambda r: f"What is {r.choice(TOPICS)}?",
    lambda r: f"Give me three interesting facts about {r.choice(TOPICS)}.",
    lambda r: f"Write a short poem about {r.choice(THINGS)}.",
    lambda r: f"Describe {r.choice(THINGS)} in two sentences.",
    lambda r: f"Give me three tips for {r.choice(ACTIVITIES)}.",
    lambda r: f"What are some common mistakes people make when {r.choice(ACTIVITIES)}?",
    lambda r: f"Write a Python function that {r.choice(TASKS)}.",
    lambda r: "What is the difference between {} and {}?".format(*r.choice(PAIRS)),
    lambda r: f"Describe a typical day of a {r.choice(JOBS)}.",
    lambda r: f"Translate into French: {r.choice(SENTENCES)}",
    lambda r: f"What is {r.randint(2, 99)} plus {r.randint(2, 99)}?",
    lambda r: f"What is {r.randint(2, 20)} times {r.randint(2, 20)}?",
    lambda r: f"If I have {r.randint(3, 30)} apples and eat {r.randint(1, 3)}, how many are left?",
    lambda r: f"Write a short story for children about {r.choice(THINGS)}.",
    lambda r: f"Summarize why {r.choice(TOPICS)} matters, in one paragraph.",
]


def rows(n: int, seed: int = 0) -> list[dict]:
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        instruction = rng.choice(TEMPLATES)(rng)
        if instruction not in seen:
            seen.add(instruction)
            out.append({"instruction": instruction, "input": "", "output": ""})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("instructions.jsonl")
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows(N))
    path.write_text(text, encoding="utf-8")
    print(f"{path}: {N} rows")
